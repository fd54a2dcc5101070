"""The public record contract of dcp-gateway (docs/record-format.md): what engine, gateway and connectors share."""
