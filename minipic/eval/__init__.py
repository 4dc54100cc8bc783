"""``minipic eval``: how much each mode changes the answers, paired against full attention.

Modules: ``datasets`` (built-in QA and your JSONL), ``runner`` (every item under full attention
and each mode, paired; the summary), ``metrics`` (the numbers, pure functions), ``report``
(``evaluate()``, the table, the plot, the files), ``cli`` (the command line; its docstring is
``minipic eval --help``'s).
"""

from minipic.eval.cli import add_subparser, run
from minipic.eval.report import evaluate, plot, table, write

__all__ = ["add_subparser", "evaluate", "plot", "run", "table", "write"]
