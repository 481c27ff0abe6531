"""SGLang as the hidden-state engine: the launch recipe (every `sglang.launch_server` command
the pipeline runs) and the SGLang plugin loaded inside its processes."""
