"""The target model, as both phases use it: loading it cut after its last captured layer, describing
and identifying it from its config, capturing its hidden states, and the built-in `tiny` target
with its assets (`tiny_target/`, package data)."""
