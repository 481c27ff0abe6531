"""The core every stage shares: errors, atomic writes, hashing, the config and the resolved run
description, the aux-layer convention, disk space, and what every shard job does alike."""
