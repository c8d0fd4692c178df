"""Encrypted volumes: the names every component agrees on.

A StorageClass parameter asks for encryption; the driver keeps it in the
volume's context, so every node component (shim, proxy, handlers) reads it
there. The passphrase is the pod's node-publish secret under one key; it
travels kubelet -> proxy -> the claiming handler -> the guest, in memory
only (docs/encryption.md, "The key's path").
"""

from __future__ import annotations

from crust.common.errors import InvalidArgument

# StorageClass parameter, kept verbatim in the volume context.
PARAMETER = "crust.dev/encryption"
LUKS2 = "luks2"
SUPPORTED = (LUKS2,)
# The key of the passphrase in NodePublishVolumeRequest.secrets (the
# Secret named by csi.storage.k8s.io/node-publish-secret-name/-namespace).
PASSPHRASE_KEY = "passphrase"
# The data offset of the LUKS2 volumes crust makes (the guest's luksFormat
# --offset, checked again before every open): the file system inside is this
# much smaller than the device (an xfs volume needs 300 MiB inside).
HEADER_BYTES = 16 * 1024 * 1024
# StorageClass parameter: LUKS2's authenticated mode (dm-integrity under
# dm-crypt in the guest), so a host that alters ciphertext makes the pod
# read an I/O error instead of altered data. Needs the encryption above.
INTEGRITY_PARAMETER = "crust.dev/integrity"
HMAC_SHA256 = "hmac-sha256"
INTEGRITY_SUPPORTED = (HMAC_SHA256,)
# A LUKS2 passphrase is read by cryptsetup up to 8 MiB; a secret that large
# is a mistake, and it would sit in every claim answer.
MAX_PASSPHRASE_BYTES = 512


def of_context(context, field: str = "volume_context") -> str:
    """The encryption a volume context asks for ("" for none); an unknown
    value is INVALID_ARGUMENT naming the key."""
    value = context.get(PARAMETER, "")
    if value and value not in SUPPORTED:
        raise InvalidArgument(f"{field}[{PARAMETER!r}] must be one of {', '.join(SUPPORTED)}, got {value!r}")
    return value


def integrity_of(context, field: str = "volume_context") -> str:
    """The integrity a volume context asks for ("" for none); an unknown
    value, or integrity without LUKS2, is INVALID_ARGUMENT naming the key."""
    value = context.get(INTEGRITY_PARAMETER, "")
    if not value:
        return ""
    if value not in INTEGRITY_SUPPORTED:
        raise InvalidArgument(f"{field}[{INTEGRITY_PARAMETER!r}] must be one of {', '.join(INTEGRITY_SUPPORTED)}, "
                              f"got {value!r}")
    if context.get(PARAMETER, "") != LUKS2:
        raise InvalidArgument(f"{field}[{INTEGRITY_PARAMETER!r}] needs {field}[{PARAMETER!r}] = {LUKS2!r}: "
                              "integrity is LUKS2's authenticated mode")
    return value


def room_inside(size: int, integrity: str) -> int:
    """Bytes an encrypted volume needs on top of the size of the file
    system inside it: the LUKS2 header, and with integrity dm-integrity's
    tags (32 bytes per 4 KiB sector) and journal. Measured in the guest:
    6.1 MiB beside a 378 MiB file system; this allows 1/64 of the size plus
    8 MiB."""
    return HEADER_BYTES + ((size // 64 + 8 * 1024 * 1024) if integrity else 0)


def required_features(encrypted: str, integrity: str) -> list[str]:
    """The registry features a handler must have registered to be handed
    the key of a volume encrypted so: it opens such volumes, in its guest,
    honouring the integrity too (one that ignored it would make the volume
    without it, silently)."""
    features = [encrypted] if encrypted else []
    if integrity:
        features.append(f"integrity-{integrity}")
    return features


def passphrase_of(secrets) -> bytearray:
    """The node-publish secret's passphrase, as a bytearray the caller wipes
    (crust.contract.encryption.wipe) once it is handed on."""
    value = secrets.get(PASSPHRASE_KEY, "")
    if not value:
        raise InvalidArgument(f"secrets[{PASSPHRASE_KEY!r}] is required for an encrypted volume: name a Secret "
                              "with csi.storage.k8s.io/node-publish-secret-name and -namespace in the StorageClass")
    key = bytearray(value.encode())
    if len(key) > MAX_PASSPHRASE_BYTES:
        wipe(key)
        raise InvalidArgument(f"secrets[{PASSPHRASE_KEY!r}] is longer than {MAX_PASSPHRASE_BYTES} bytes")
    return key


def wipe(key: bytearray | None) -> None:
    """Overwrite a key in place. Copies Python made on the way (the str of
    the protobuf field, the bytes of a gRPC frame) are beyond reach: they are
    freed, not overwritten."""
    if key is not None:
        for i in range(len(key)):
            key[i] = 0
