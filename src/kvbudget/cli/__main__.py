"""``python -m kvbudget.cli``: the ``kvbudget`` command."""

from kvbudget.cli import app

if __name__ == "__main__":  # pragma: no cover
    app()
