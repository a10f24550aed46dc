"""The gateway's per-frame request path: a request batch decoded once, screened, grouped and routed per
group (groups.py), each request's bytes found in the payload (wire.py), answers assembled per group
(answers.py). gateway/ingest.py drives it for every frame; gateway/dispatch/ queues and serves slices."""
