"""The `arle` command line (typer). Entry point: `arle.cli.app:main`."""
