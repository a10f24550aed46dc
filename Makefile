# The two commands of the README. Everything else is in scripts/.
.PHONY: run test bench proto

# Passed through: make test ARGS="-m triton" (pytest's arguments), make run ARGS="--requests 2000".
ARGS ?=

# onnxruntime otherwise keeps a telemetry database and a device id under ~/.cache/Microsoft and a session
# file in $TMPDIR, from every process that loads it; it reads this once, at import.
export ORT_DISABLE_TELEMETRY := 1

# Each run's temporary files (multiprocessing's pymp-* sockets, pytest's tmp_path, pip's builds: whatever
# honours TMPDIR) go to a directory of the run's own, removed when the run ends, also after a test killed a
# process that could not clean up after itself. Short, under /tmp: tests put unix sockets in tmp_path.
own_tmp = tmp=$$(mktemp -d /tmp/hkeg-$@.XXXXXX) && trap 'rm -rf "$$tmp"' EXIT INT TERM && export TMPDIR="$$tmp" &&

run:
	@$(own_tmp) scripts/run.sh $(ARGS)

test:
	@$(own_tmp) scripts/test.sh $(ARGS)

bench:
	@$(own_tmp) scripts/setup.sh && \
	for bench in compression routing_bench cpu_stage_bench gateway_bench agent_bench replay_bench ingest_bench; do \
	    .venv/bin/python -m bench.$$bench --write || exit; \
	done

proto:
	.venv/bin/python scripts/gen_proto.py
