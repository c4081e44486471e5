"""The chat page at GET / in a real browser: Debian's chromium, headless, driven through chromedriver by
selenium, on a server in this process (the built-in default model, CPU) started with an API key. The page
loads without the key and asks for it; a reply streams into the page (text shown before the stream ends)
and ends as the same request's non-streamed reply (greedy), thinking folded above the answer, tok/s under
it; an API error shows in the page; Stop aborts a long reply and the server frees its slot.

Needs `chromium` and `chromedriver` on the PATH (`apt-get install -y chromium chromium-driver`; .ci/run
installs them): missing, a skip, and under CI=true a failure."""
import io
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request

import pytest

from conftest import require

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
require("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from test_server import in_process  # noqa: E402

KEY = "page-secret"
MAX_CONTEXT = 4096


def browser() -> tuple[str, str]:
    """chromium's and chromedriver's paths; missing, a skip naming the packages (under CI=true a failure)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    missing = " and ".join(name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path)
    message = (f"{missing} not found: the chat page's browser test needs Debian's chromium and chromium-driver "
               "(apt-get install -y chromium chromium-driver)")
    if os.environ.get("CI") == "true":
        pytest.fail(message + ", under CI=true", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def served():
    """(url, the server, its log): the built-in model behind --api-key KEY, two slots."""
    from qwen38_model import Qwen38ForCausalLM
    from qwen38_model.default_model import default_model_path
    from qwen38_model.server import Server
    from qwen38_model.tokenizer import load_tokenizer

    path = default_model_path()
    model = Qwen38ForCausalLM.from_pretrained(path, device="cpu")
    log = io.StringIO()
    server = Server(model, load_tokenizer(path), path.name, max_context=MAX_CONTEXT, max_queue=2,
                    cache_bytes=1 << 26, api_key=KEY, log=log, max_batch=2)
    with in_process(server) as url:
        yield url, server, log


@pytest.fixture(scope="module")
def page(served):
    chromium, driver_path = browser()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start; /dev/shm is small in containers.
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.get(served[0] + "/")
        yield driver
    finally:
        driver.quit()


def api(url: str, body: dict) -> dict:
    """The non-streamed /v1/chat/completions answer to body, with the key."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait(driver, condition, timeout: float = 60):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition())


def text(element) -> str:
    """An element's text as the page put it there (textContent: not the rendered, whitespace-folded text)."""
    return element.get_property("textContent")


def set_field(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def set_thinking(driver, on: bool) -> None:
    box = driver.find_element(By.ID, "thinking")
    if box.is_selected() != on:
        box.click()


def enter_key(driver, model: str) -> None:
    """The API key typed into the page (on change it loads the model's name), unless it is in already."""
    if text(driver.find_element(By.ID, "model")) != model:
        driver.find_element(By.ID, "api-key").send_keys(KEY, Keys.TAB)
        wait(driver, lambda: text(driver.find_element(By.ID, "model")) == model)


def last_reply(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def send(driver, message: str):
    """Types message, sends it with Enter, and returns the reply's element (once it is there)."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    driver.find_element(By.ID, "input").send_keys(message, Keys.ENTER)
    wait(driver, lambda: len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant")) > before)
    return last_reply(driver)


# Records, at every change in the message list, the state and the text length of the last reply, so that the
# test sees what the page showed while the reply was streaming (not only what it ends with).
WATCH = """
window.seen = [];
new MutationObserver(() => {
  const reply = document.querySelector(".message.assistant:last-child");
  if (reply) window.seen.push([reply.dataset.state, reply.querySelector(".content").textContent.length +
                                                    reply.querySelector(".reasoning").textContent.length]);
}).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
"""


def test_page_is_open_and_self_contained(served):
    """GET / answers the page without the key (the key still guards the API), and the page names no URL
    elsewhere: it works offline."""
    url = served[0]
    with urllib.request.urlopen(url + "/", timeout=30) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/html")
        html = response.read().decode()
    assert "<title>qwen38 chat</title>" in html
    assert not re.search(r"https?:|//[a-z]|\bsrc=|@import|url\(", html), "the page must not load anything"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/v1/models", timeout=30)
    assert refused.value.code == 401


def test_key_then_streamed_replies_as_the_api_answers(served, page):
    url, server, _ = served
    model = server.model_name
    # Without the key: /v1/models' 401 is shown, and the page asks for the key.
    wait(page, lambda: "401" in text(page.find_element(By.ID, "notice")))
    assert "API key" in text(page.find_element(By.ID, "notice"))
    enter_key(page, model)
    assert text(page.find_element(By.ID, "notice")) == ""

    # Thinking off, greedy: the streamed reply is the non-streamed one's content.
    set_field(page, "temperature", "0")
    set_field(page, "max-tokens", "32")
    set_thinking(page, False)
    page.execute_script(WATCH)
    reply = send(page, "Hello there")
    wait(page, lambda: reply.get_attribute("data-state") != "streaming")
    expected = api(url, {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 32,
                         "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})
    answer = expected["choices"][0]["message"]
    assert reply.get_attribute("data-state") == "done"
    content = text(reply.find_element(By.CSS_SELECTOR, ".content"))
    assert content == answer["content"] and len(content) > 0
    streaming = {n for state, n in page.execute_script("return window.seen") if state == "streaming" and n > 0}
    assert len(streaming) >= 2 and min(streaming) < len(content), streaming  # shown piece by piece
    stats = text(reply.find_element(By.CSS_SELECTOR, ".stats"))
    tokens = expected["usage"]["completion_tokens"]
    assert re.search(rf"(^| · ){tokens} tokens · \d+\.\d tok/s · first token after \d+\.\d\d s$", stats), stats
    assert not reply.find_element(By.CSS_SELECTOR, ".thinking").is_displayed()  # no reasoning: no block

    # Thinking on: the conversation goes on (the first exchange sent back); the reasoning is in a folded
    # <details> above the answer.
    set_thinking(page, True)
    set_field(page, "max-tokens", "64")
    reply = send(page, "What else?")  # greedy, thinks and answers within 64 tokens
    wait(page, lambda: reply.get_attribute("data-state") != "streaming")
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": answer["content"]},
               {"role": "user", "content": "What else?"}]
    answer = api(url, {"model": model, "messages": history, "max_tokens": 64, "temperature": 0})
    answer = answer["choices"][0]["message"]
    assert reply.get_attribute("data-state") == "done"
    thinking = reply.find_element(By.CSS_SELECTOR, ".thinking")
    assert answer["reasoning_content"] and answer["content"]
    assert thinking.is_displayed() and thinking.get_attribute("open") is None  # shown, folded
    assert text(reply.find_element(By.CSS_SELECTOR, ".reasoning")) == answer["reasoning_content"]
    assert text(reply.find_element(By.CSS_SELECTOR, ".content")) == answer["content"]
    assert page.execute_script("return arguments[0].querySelector('.thinking').nextElementSibling === "
                               "arguments[0].querySelector('.content')", reply)  # above the answer


def test_api_error_is_shown(served, page):
    """A request the server refuses (prompt + max_tokens over the context): its message in the reply, and the
    message left out of the conversation."""
    enter_key(page, served[1].model_name)
    set_field(page, "max-tokens", str(MAX_CONTEXT * 10))
    reply = send(page, "Too long a reply")
    wait(page, lambda: reply.get_attribute("data-state") != "streaming")
    assert reply.get_attribute("data-state") == "error"
    error = reply.find_element(By.CSS_SELECTOR, ".error")
    assert error.is_displayed() and text(error).startswith("400: ") and "max_tokens" in text(error), text(error)
    assert "unsent" in page.find_elements(By.CSS_SELECTOR, ".message.user")[-1].get_attribute("class")


def test_stop_aborts_the_reply_and_frees_the_slot(served, page):
    url, server, log = served
    enter_key(page, server.model_name)
    page.find_element(By.ID, "new-chat").click()
    set_field(page, "temperature", "0")
    set_field(page, "max-tokens", "2000")
    set_thinking(page, False)
    reply = send(page, "Write a long essay")  # greedy, its reply runs 379 tokens
    content = reply.find_element(By.CSS_SELECTOR, ".content")
    wait(page, lambda: len(text(content)) > 0)
    assert reply.get_attribute("data-state") == "streaming"
    assert page.find_element(By.ID, "send").get_attribute("disabled") is not None
    page.find_element(By.ID, "stop").click()
    wait(page, lambda: reply.get_attribute("data-state") != "streaming", timeout=10)
    assert reply.get_attribute("data-state") == "stopped"
    assert text(reply.find_element(By.CSS_SELECTOR, ".stats")).startswith("stopped · ~")
    assert page.find_element(By.ID, "stop").get_attribute("disabled") is not None
    assert page.find_element(By.ID, "send").get_attribute("disabled") is None

    def health() -> dict:
        with urllib.request.urlopen(url + "/health", timeout=30) as response:
            return json.loads(response.read())

    deadline = time.monotonic() + 10
    while (state := health())["running"] or state["waiting"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    # The server's log line for it: ended early, well before the reply's end.
    [line] = [line for line in log.getvalue().splitlines() if "ended early" in line]
    out = int(re.search(r", (\d+) out, ", line).group(1))
    assert 0 < out < 200, line
