"""The ``dcpgw`` command line.

Commands now: ``dcpgw version`` and ``dcpgw broker`` (run the embedded Tansu broker in the foreground).
``up``, ``load``, ``status`` and ``tail`` come with the gateway issue.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import typer

from gateway import __version__
from gateway.broker import EmbeddedTansuBroker
from gateway.exceptions import BrokerStartError

app = typer.Typer(
    name="dcpgw",
    help="dcp-gateway: stream a Couchbase-style DCP change feed into Kafka.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the dcp-gateway version."""
    typer.echo(__version__)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command()
def broker(
    port: int = typer.Option(0, help="Loopback port to listen on; 0 picks a free one."),
    start_timeout: float = typer.Option(30.0, help="Seconds to wait for the broker to get ready."),
) -> None:
    """Run the embedded Tansu Kafka-protocol broker (memory only) until Ctrl-C.

    Prints the bootstrap address for clients (KAFKA_BOOTSTRAP_SERVERS). Nothing is kept after it stops.
    """
    embedded = EmbeddedTansuBroker(port=port or None, start_timeout=start_timeout)
    try:
        embedded.start()
    except BrokerStartError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    # SIGTERM (docker stop, kill) stops the broker in order, like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        typer.echo(f"embedded Tansu broker (pid {embedded.pid}) listening")
        typer.echo(f"KAFKA_BOOTSTRAP_SERVERS={embedded.bootstrap_servers}")
        typer.echo(f"log: {embedded.log_path}")
        typer.echo("Ctrl-C to stop.")
        while (status := embedded.poll()) is None:
            time.sleep(0.5)
        typer.echo(
            f"error: broker exited unexpectedly with status {status}; log: {embedded.log_path}", err=True
        )
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo("stopping broker")
    finally:
        embedded.stop()
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    app()
