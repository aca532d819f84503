"""Evaluation: tasks yielding :class:`~kvbudget.eval.sample.Sample`, metrics, runner and reports."""
