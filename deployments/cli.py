"""The `insight-queue` command: the store's verbs plus serving, triggers and tools."""

from __future__ import annotations

import click

from queue_store.cli import COMMANDS, settings_help


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="\b\nSettings (environment variables):\n" + settings_help(),
)
@click.option(
    "--database-url",
    default=None,
    metavar="URL",
    help="store URL (overrides AI_JOB_DATABASE_URL; default: SQLite in the data dir)",
)
def main(database_url: str | None) -> None:
    """insight-queue: slow, scarce LLM work for an app's screens, in priority order."""


for command in COMMANDS:
    main.add_command(command)
