"""`hicache-server`: the standalone shared page store (`protocol`, `store`, `server`)."""
