"""Parameter-server shard service: global weights, per-VW clocks, WSP push/pull."""
