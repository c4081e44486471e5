"""Each qwen38 op in plain PyTorch: the specification. Float64-capable, never imports the extension.
Functions take the op's schema arguments and write their outputs in place."""
