"""The built-in reference server: a transformers model behind SGLang's HTTP subset, batching
concurrent requests, dumping hidden states through the handoff; one process of its own."""
