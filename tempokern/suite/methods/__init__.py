"""Rows of the English comparison suite. Every module in this package is imported by the runner
(``tempokern.suite.load_methods``) and registers its methods with ``tempokern.suite.register``;
a module that fails to import is reported in the results, never skipped silently. Add a row by
adding a module here (e.g. ``tmrl.py``, ``re3.py``)."""
