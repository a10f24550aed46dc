"""The main job of the README (`make run`): a real hk-gateway and edge agents under synthetic traffic.

The one package that may import both programs (gateway and edge_agent)."""
