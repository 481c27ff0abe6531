"""Regeneration: the target re-answers the dataset's assistant turns before prepare (one job
per shard): the generation client, the per-shard job, and the regenerated rows' files."""
