"""Input data: dataset formats and bad rows, chat templates and loss masks, the target's
tokenizer, and the embedded toy target built from the sample conversations."""
