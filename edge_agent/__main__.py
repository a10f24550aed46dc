from edge_agent.cli import main

if __name__ == "__main__":  # not when a worker process imports this module as __mp_main__
    raise SystemExit(main())
