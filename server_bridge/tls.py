"""TLS to the MQTT broker for the bridge's connections and host clients.

`BrokerTLS` names a CA to check the broker's certificate against (the system's trusted
CAs when none is given: a cloud broker with a public certificate) and, for a broker that
asks clients for one (Mosquitto's `require_certificate true`), a client certificate and
its key, all PEM files. The SSL context is built once, when the value is made, so a
missing or unreadable file is a `TLSConfigError` naming it at start-up rather than a
failed connection later; every connection of a bridge process shares that context
(`apply`). The broker's host name is checked against its certificate, as paho does by
default.

The board's side is edge_runtime/tls.py (settings `tls`: a CA on its flash).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TLS_PORT", "BrokerTLS", "TLSConfigError"]

# MQTT over TLS's port (IANA's secure-mqtt): the default wherever TLS is asked for and no
# port given.
TLS_PORT = 8883


class TLSConfigError(ValueError):
    """A CA, certificate or key file that cannot be used; the message names the file and
    why."""


@dataclass(frozen=True)
class BrokerTLS:
    """TLS settings of a connection to the broker (module docstring)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    context: ssl.SSLContext = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.key is not None and self.cert is None:
            raise TLSConfigError("a client key needs its certificate (--broker-cert)")
        for what, path in (("CA", self.ca), ("client certificate", self.cert),
                           ("client key", self.key)):  # fmt: skip
            if path is not None and not Path(path).is_file():
                raise TLSConfigError(f"broker TLS: the {what} file {path} does not exist")
        try:
            ctx = ssl.create_default_context(cafile=None if self.ca is None else str(self.ca))
        except (ssl.SSLError, OSError, ValueError) as e:
            raise TLSConfigError(f"broker TLS: the CA file {self.ca} is not usable: {e}") from e
        if self.cert is not None:
            try:
                ctx.load_cert_chain(str(self.cert), None if self.key is None else str(self.key))
            except (ssl.SSLError, OSError, ValueError) as e:
                raise TLSConfigError(
                    f"broker TLS: the client certificate {self.cert} and key "
                    f"{self.key or '(in the same file)'} are not usable: {e}"
                ) from e
        # Frozen: set once, here, the only place it is made.
        object.__setattr__(self, "context", ctx)

    def apply(self, client: Any) -> None:
        """TLS on a paho client, before it connects."""
        client.tls_set_context(self.context)
