"""One module per op, declaring its OpDef (_opdef.py: the custom ops, autograd and dispatch built from it);
call_plan.py: what a call decides from its arguments' metadata, once per signature."""
