"""Published multi-GPU runs (xDiT, cache-dit, ParaAttention, Raylight, ...) and what the cost model makes of them:
data the planner's constants are fitted to (engine/parallel/fitted.py holds the fitted values) and judged on, read by
the planner's tests and `python -m engine plan --validate`. Nothing the engine runs imports it."""
