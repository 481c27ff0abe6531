"""Prepare: the tokenized table with loss masks, row ids and the held-out split."""
