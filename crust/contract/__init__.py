"""The contract between the crust proxy and runtime handlers.

What both sides of the watched directory agree on, in one package that the
proxy, the handler library (crust.runtime_handler) and the microVM handler
(crust.kata) all import, and that imports none of them:

- mountinfo: the mountInfo.json record (Kata's keys plus crust's), its JSON
  schema (specs/mountinfo.schema.json), and the names of entries: the hex
  sha256 of the target path, Kata's base64url mirror name;
- volumes_dir: the directory itself: entries written atomically and reached
  without following a symlink, the Kata mirror, the sandbox-id claim marker
  and its naming rule, runtime-cli.

docs/protocol.md describes the contract module by module.
"""
