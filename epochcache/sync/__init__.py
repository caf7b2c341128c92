"""The sync daemon's parts, one concept per module; :mod:`epochcache.sync.daemon` wires them together.

``report`` (what a run did), ``stream`` (one source as walked), ``claims`` (units cached or on their
way), ``intake`` (reads counted and throttled), ``skips`` (failed units recorded and read again),
``identity`` (what fixes a stream's order and the cache's dataset), ``walk`` (streams merged by
weight), ``window`` (concurrent reads consumed in order), ``assembly`` (rows gathered into a shard),
``writer`` (shards written and published in order by one thread), ``vitals`` (the daemon's state
for ``epochcache status``), ``slicing`` (a pass's row slices and mixing window), ``notes`` (a full
ledger disk waited out, or its bookkeeping dropped).
"""
