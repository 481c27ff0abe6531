"""What a run will do, decided at parse time: the shard plan, each stage's provenance stamp,
and the rerun policy (which outputs are fresh)."""
