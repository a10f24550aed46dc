"""Model repositories the gateway writes for remote servers (Triton, GPU builds of the demo models)."""
