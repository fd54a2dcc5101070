"""``dcpgw xdcr``: replicate a gateway topic into a target cluster (connectors/xdcr, docs/xdcr.md).

``dcpgw xdcr --topic TOPIC --target couchbase://HOST:KVPORT --user U --password P --state-dir DIR
[--bootstrap KAFKA] [--filter-key REGEX] [--until-caught-up]`` and ``dcpgw xdcr status --state-dir DIR``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
from pathlib import Path

import typer

xdcr_app = typer.Typer(help="XDCR: replicate a gateway topic into another cluster with Couchbase conflict "
                            "resolution (docs/xdcr.md).", invoke_without_command=True)


@xdcr_app.callback()
def xdcr(
    ctx: typer.Context,
    topic: str | None = typer.Option(None, help="Source topic (default: the running gateway's)."),
    target: str | None = typer.Option(None, help="couchbase://HOST:KVPORT or couchbase://HOST:KVPORT/BUCKET (couchbases:// for TLS)."),
    user: str | None = typer.Option(None, envvar="DCPGW_XDCR_USER", help="Target user (SASL)."),
    password: str | None = typer.Option(None, envvar="DCPGW_XDCR_PASSWORD", help="Target password."),
    state_dir: Path | None = typer.Option(None, help="The replicator's state: xdcr.sqlite (positions, changelog, "
                                          "checkpoints, counters) and dead-letter.jsonl."),
    bootstrap: str | None = typer.Option(None, envvar="KAFKA_BOOTSTRAP_SERVERS",
                                         help="Kafka bootstrap servers (default: the running gateway's)."),
    data_dir: Path = typer.Option(Path("data"), help="Where `dcpgw up` keeps its state file."),
    filter_key: str | None = typer.Option(None, help="Replicate only keys matching this regular expression."),
    skip_deletions: bool = typer.Option(False, "--filter-skip-deletions", help="Do not replicate deletions."),
    skip_expirations: bool = typer.Option(False, "--filter-skip-expirations", help="Do not replicate expirations."),
    skip_binary: bool = typer.Option(False, "--filter-skip-binary", help="Do not replicate binary (non-JSON) docs."),
    restream: bool | None = typer.Option(None, "--restream/--no-restream",
                                         help="When the filters changed: replicate everything again, or apply "
                                              "them from the current positions on (one is required then)."),
    conflict_resolution: str = typer.Option("seqno", envvar="DCPGW_CONFLICT_RESOLUTION",
                                            help="The source bucket's mode (seqno|lww); the target must match."),
    until_caught_up: bool = typer.Option(False, "--until-caught-up",
                                         help="Exit 0 once every vbucket is applied up to the partition ends."),
    http_port: int | None = typer.Option(None, help="Serve /status and /metrics (Prometheus) on this port."),
    batch_docs: int = typer.Option(500, min=1, help="Documents per batch."),
    batch_bytes: int = typer.Option(2 << 20, min=1, help="Bytes per batch."),
    optimistic_threshold: int = typer.Option(256, min=0, help="Larger documents are checked with GET_META first."),
    give_up_after: float | None = typer.Option(None, min=0.0, help="Stop retrying an unreachable or refusing "
                                                                   "target after this many seconds (exit 3)."),
) -> None:
    """Replicate TOPIC into the TARGET cluster's bucket with the source's metadata (subcommand: status)."""
    if ctx.invoked_subcommand is not None:
        return
    from connectors.exceptions import ConnectorError
    from connectors.xdcr.document import ConflictMode
    from connectors.xdcr.errors import TargetAuthError, TargetUnreachable
    from connectors.xdcr.filters import Filters
    from connectors.xdcr.metrics import StatusServer
    from connectors.xdcr.replicator import XdcrReplicator, XdcrSettings
    from gateway.cli import _fail, _kafka_client, _state

    if target is None or state_dir is None:
        _fail("dcpgw xdcr needs --target couchbase://HOST:KVPORT and --state-dir DIR")
    st = _state(data_dir)
    bootstrap = bootstrap or st.get("bootstrap_servers")
    topic = topic or st.get("topic")
    if not bootstrap or not topic:
        _fail("no running gateway found: pass --bootstrap and --topic (or set KAFKA_BOOTSTRAP_SERVERS)")
    try:
        mode = ConflictMode(conflict_resolution)
    except ValueError:
        _fail(f"--conflict-resolution must be seqno or lww, got {conflict_resolution!r}")
    logging.basicConfig(level=os.environ.get("DCPGW_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(message)s")
    kafka = _kafka_client(bootstrap)
    server: StatusServer | None = None
    try:
        settings = XdcrSettings(batch_docs=batch_docs, batch_bytes=batch_bytes,
                                optimistic_threshold=optimistic_threshold, conflict_resolution=mode,
                                filters=Filters(filter_key, skip_deletions, skip_expirations, skip_binary),
                                restream=restream, give_up_after=give_up_after)
        with XdcrReplicator(kafka, topic, target, state_dir, user=user, password=password, settings=settings) as rep:
            signal.signal(signal.SIGTERM, lambda *_: rep.stop())
            signal.signal(signal.SIGINT, lambda *_: rep.stop())
            if http_port is not None:
                server = StatusServer(rep.status, port=http_port)
                typer.echo(f"dcpgw xdcr: status on http://127.0.0.1:{server.port}/status", err=True)
            with contextlib.suppress(KeyboardInterrupt):
                rep.run(until_caught_up=until_caught_up)
            s = rep.status()
            c = s["counters"]
            typer.echo(json.dumps({"topic": topic, "target": target, "written": c["written"],
                                   "rejected": c["rejected"], "filtered": c["filtered"],
                                   "rollbacks": c["rollbacks"], "restored": c["restored"],
                                   "dead_letters": c["dead_letters"], "vbuckets": len(s["vbuckets"])}))
    except (TargetUnreachable, TargetAuthError) as e:
        typer.echo(f"error: target {target}: {e}", err=True)
        raise typer.Exit(3) from None
    except ConnectorError as e:
        _fail(str(e))
    except (sqlite3.Error, OSError) as e:
        _fail(f"state directory {state_dir}: {e}")
    finally:
        if server is not None:
            server.close()


@xdcr_app.command("status")
def status(state_dir: Path = typer.Option(..., help="The replicator's state directory.")) -> None:
    """Print the per-vbucket positions and counters the replicator last committed (JSON)."""
    from connectors.xdcr.errors import XdcrError
    from connectors.xdcr.replicator import read_status
    from gateway.cli import _fail

    try:
        typer.echo(json.dumps(read_status(state_dir), indent=1))
    except XdcrError as e:
        _fail(str(e))
