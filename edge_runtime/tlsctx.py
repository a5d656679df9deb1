# The SSL context of a board's TLS settings (tls.py): the CA file on flash read, parsed
# and trusted. Its own module, loaded at the link's first TLS connection and let go once
# the context is made (platform.unload): its code is then not on the heap where a run
# peaks (1 KiB of it on the 64-bit unix port, from .mpy: what tls.py's import cost
# with it and without).
from edge_runtime.platform import IS_MICROPYTHON, log, read_file


def context(settings):
    # The SSL context of the settings' CA, or ValueError naming what is wrong with it.
    name = settings.get("ca")
    data = read_file(name) if name else None
    if not data:
        raise ValueError("tls: no CA file %r on flash" % name)
    pem = b"-----BEGIN" in data
    if not IS_MICROPYTHON:
        import ssl

        try:
            # Checks the chain, the dates and the host name.
            return ssl.create_default_context(cadata=data.decode() if pem else data)
        except (ValueError, OSError) as e:
            raise ValueError("tls: %s holds no usable certificate (%s)" % (name, e))
    try:
        import tls
    except ImportError:
        raise ValueError("tls: this MicroPython has no tls module (built without SSL)")
    import time

    # A board's clock starts in 2000 (2021 on an rp2) until NTP sets it, and mbedTLS
    # checks the certificate's dates against it: every one would be "not yet valid".
    # So it is set here from NTP where the firmware has ntptime (ESP32, rp2: one UDP
    # exchange, bounded by ntptime's own 1 s timeout), once per context; where it cannot
    # be, that is said once and the refusals say the rest.
    if time.gmtime()[0] < 2025:
        try:
            import ntptime

            ntptime.settime()
            log("tls: clock set by NTP")
        except Exception as e:  # no ntptime (the unix port), no answer, no network
            log("tls: the clock reads %d and NTP could not set it (%r): set it before "
                "connecting" % (time.gmtime()[0], e))
    ctx = tls.SSLContext(tls.PROTOCOL_TLS_CLIENT)
    # Said, not assumed: micropython-lib's ssl wrapper turns checking off by default.
    ctx.verify_mode = tls.CERT_REQUIRED
    try:
        if not pem:
            ctx.load_verify_locations(data)
            return ctx
        # The ports' mbedTLS is built without PEM (the unix port's, rp2's): each
        # certificate of the file is handed over as the DER its base64 holds.
        from binascii import a2b_base64

        for part in data.split(b"-----BEGIN CERTIFICATE-----")[1:]:
            ctx.load_verify_locations(a2b_base64(part.split(b"-----END")[0]))
        return ctx
    except (ValueError, OSError) as e:
        raise ValueError("tls: %s holds no usable certificate (%s)" % (name, e))
