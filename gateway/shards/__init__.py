"""Ingest shards: ``hk-gateway`` on every core behind the same carrier addresses (docs/GATEWAY.md section 8).

With ``shards = 1`` the gateway is one process (gateway/server.py). With more, the process started by
systemd is the **front** (front.py): it binds the carriers' ROUTERs (CurveZMQ and ZAP included), serves
health and the merged metrics, and forwards each agent frame, raw, to the shard its agent belongs to
(placement.py: crc32 of the authenticated agent id, modulo the shard count). Each **shard** is a child
process running the whole gateway (decode, dedupe, routing, pools, CPU workers, answers) on its own event
loop; its "carriers" are views of one link to the front (link.py). The front restarts a shard that dies
(supervisor.py) and merges every shard's metrics into one exposition (merge.py).
"""
