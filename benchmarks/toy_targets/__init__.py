"""Random and toy targets the benchmarks build: models, tokenizers and the rows fed to them."""
