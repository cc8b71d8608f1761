#!/usr/bin/env python3
"""Checks outbox-relay's `outbox-signature` header (docs/wire-format.md) with the Python
standard library only: the consumer's recipe docs/wire-format.md shows (`verify` below), and the
implementation tests/signing.rs checks real messages with, independent of the relay's own.

stdin:  {"keys": {"<key id>": "<key, standard base64>"},
         "messages": [{"header", "id", "source", "type", "subject", "route", "time",
                       "datacontenttype", "body_base64"}]}
stdout: a JSON list with true or false per message.
"""
import base64
import hashlib
import hmac
import json
import sys


# docs: begin python
def verify(header, keys, id, source, type, subject, route, time, content_type, body):
    """True if `header` is a valid v1 signature of this message under `keys` (key id -> bytes)."""
    version, _, rest = header.partition(";")
    fields = dict(part.split("=", 1) for part in rest.split(";") if "=" in part)
    key = keys.get(fields.get("kid"))
    if version != "v1" or key is None:
        return False  # unknown version or key id: not ours
    canonical = "\n".join(["v1", id, source, type, subject or "", route, time, content_type,
                           hashlib.sha256(body).hexdigest()])
    mac = hmac.new(key, canonical.encode("utf-8"), hashlib.sha256).digest()
    return hmac.compare_digest(base64.b64encode(mac).decode("ascii"), fields.get("sig", ""))
# docs: end python


def main():
    request = json.load(sys.stdin)
    keys = {kid: base64.b64decode(k) for kid, k in request["keys"].items()}
    verdicts = [
        verify(m["header"], keys, m["id"], m["source"], m["type"], m["subject"], m["route"],
               m["time"], m["datacontenttype"], base64.b64decode(m["body_base64"]))
        for m in request["messages"]
    ]
    json.dump(verdicts, sys.stdout)


if __name__ == "__main__":
    main()
