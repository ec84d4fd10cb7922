"""The HTTPS flags (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs), checked when
the flags are read, before the model loads: uvicorn would only load the files once the server
starts, and a bad one would then stop it with a traceback."""

from __future__ import annotations

import argparse
import os
import ssl


def check_ssl(ns: argparse.Namespace) -> None:
    """The HTTPS flags, checked before the model loads: the files exist and load as uvicorn will
    load them (a certificate with its key, CA certificates)."""
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(ns, flag)
        if path is not None and not os.path.isfile(path):
            what = "a directory, not a file" if os.path.isdir(path) else "no such file"
            raise ValueError(f"--{flag.replace('_', '-')} {path}: {what}")
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    if ns.ssl_certfile is None:
        if ns.ssl_ca_certs is not None or ns.ssl_cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs check client certificates, which "
                             "needs HTTPS: give --ssl-keyfile and --ssl-certfile too")
        return
    if ns.ssl_cert_reqs == ssl.CERT_REQUIRED and ns.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 2 (client certificates required) needs --ssl-ca-certs, "
                         "the CA certificates that verify them")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    encrypted = []

    def no_password() -> str:  # called only for an encrypted key: refuse instead of prompting
        encrypted.append(True)
        raise ValueError("encrypted")
    try:
        ctx.load_cert_chain(ns.ssl_certfile, ns.ssl_keyfile, password=no_password)
    except (ssl.SSLError, OSError, ValueError) as e:
        if encrypted:
            raise ValueError(f"--ssl-keyfile {ns.ssl_keyfile}: an encrypted private key; this "
                             "server takes an unencrypted one (e.g. `openssl pkey -in KEY -out "
                             "PLAIN`)") from None
        raise ValueError(f"--ssl-certfile {ns.ssl_certfile} with --ssl-keyfile {ns.ssl_keyfile}: "
                         f"not a PEM certificate and its private key ({e})") from None
    if ns.ssl_ca_certs is not None:
        try:
            ctx.load_verify_locations(ns.ssl_ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs {ns.ssl_ca_certs}: not PEM CA certificates ({e})") from None
