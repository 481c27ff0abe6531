"""Extraction: one job per shard sends prefill requests to the shared server, collects the
dumps and writes packed, checksummed chunks, a journal and the manifest."""
