"""What the planner prints: a plan's table and JSON, a model's, the driver flags that run it,
plots, the verdict over a table of cases."""
