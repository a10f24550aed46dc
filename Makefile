# The two commands of the README. Everything else is in scripts/.
.PHONY: run test bench proto

run:
	scripts/run.sh

test:
	scripts/test.sh

bench:
	scripts/setup.sh
	.venv/bin/python -m bench.compression --write
	.venv/bin/python -m bench.routing_bench --write
	.venv/bin/python -m bench.cpu_stage_bench --write
	.venv/bin/python -m bench.gateway_bench --write
	.venv/bin/python -m bench.agent_bench --write
	.venv/bin/python -m bench.replay_bench --write
	.venv/bin/python -m bench.ingest_bench --write

proto:
	.venv/bin/python scripts/gen_proto.py
