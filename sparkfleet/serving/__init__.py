"""What a host serves (controller side): the profiles and their schema, the serving plan, state.json,
the KV planner, vLLM's flag schema, the unit's state and start-up record, and the model pins."""
