"""Encrypted volumes: the names every component agrees on.

A StorageClass parameter asks for encryption; the driver keeps it in the
volume's context, so every node component (shim, proxy, handlers) reads it
there. The passphrase is the pod's node-publish secret under one key; it
travels kubelet -> proxy -> the claiming handler -> the guest, in memory
only (docs/design.md, "Encrypted volumes").
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
# LUKS2's default data offset: the file system inside is this much smaller
# than the device (an xfs volume needs 300 MiB inside).
HEADER_BYTES = 16 * 1024 * 1024
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
