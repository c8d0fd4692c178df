# The one LUKS2 shape crust makes, checked field by field (jq; the guest
# agent's luksopen runs it before it opens anything, tests run it on the host).
#
# Input: the metadata as `cryptsetup luksDump --dump-json-metadata` prints
# it, i.e. as cryptsetup itself parsed it (the same parse its open makes).
# Arguments: --arg integrity "" | "hmac-sha256" (the volume's setting).
# Output: nothing when the metadata is exactly crust's; otherwise one line
# naming up to three fields that differ, with the value found and crust's.
#
# Why every field: a header is plain text the disk's owner can rewrite. A
# null cipher in the segment (the pod's writes in clear) or in the key slot
# area (any passphrase opens, with a volume key the host chose), a shorter
# key, a second key slot, a token, a reencryption requirement, a segment
# that overlaps the header: each was a published way to turn a guest's own
# encryption against it (Trail of Bits, 2025, CVE-2025-59054). Only what
# crust's luksFormat writes is accepted; salts and digests are the only free
# values, and only their length is fixed.

def integrity_on: $integrity == "hmac-sha256";

# The volume key: 512 bits of AES-XTS, plus 256 of HMAC-SHA256 with integrity.
def volume_key_bytes: if integrity_on then 96 else 64 end;

def crust_shape: {
  keyslots: {"0": {
    type: "luks2",
    key_size: volume_key_bytes,
    af: {type: "luks1", stripes: 4000, hash: "sha256"},
    area: {type: "raw", offset: "32768",
           # 4000 anti-forensic stripes of the key, rounded up to 4096 bytes
           size: (volume_key_bytes * 4000 / 4096 | ceil * 4096 | tostring),
           encryption: "aes-xts-plain64", key_size: 64},
    kdf: {type: "pbkdf2", hash: "sha256", iterations: 1000, salt: {"base64 of bytes": 32}}}},
  tokens: {},
  segments: {"0": ({
    type: "crypt", offset: "16777216", size: "dynamic", iv_tweak: "0",
    encryption: "aes-xts-plain64",
    sector_size: (if integrity_on then 4096 else 512 end)}
    + if integrity_on
      then {integrity: {type: "hmac(sha256)", journal_encryption: "none", journal_integrity: "none"}}
      else {} end)},
  digests: {"0": {type: "pbkdf2", keyslots: ["0"], segments: ["0"], hash: "sha256", iterations: 1000,
                  salt: {"base64 of bytes": 32}, digest: {"base64 of bytes": 32}}},
  config: {json_size: "12288", keyslots_size: "16744448"}
};

def shown: tojson | if length > 60 then .[:57] + "..." else . end;

def base64_of($n):
  ($n / 3 | floor * 4) as $full
  | if $n % 3 == 0 then "^[A-Za-z0-9+/]{\($full)}$"
    elif $n % 3 == 1 then "^[A-Za-z0-9+/]{\($full + 2)}==$"
    else "^[A-Za-z0-9+/]{\($full + 3)}=$" end;

def at($path; $key): if $path == "" then $key else "\($path).\($key)" end;

# Every difference between what crust makes ($want) and what is there ($have).
def differences($path; $want; $have):
  if ($want | type) == "object" and ($want | has("base64 of bytes")) then
    if ($have | type) == "string" and ($have | test(base64_of($want["base64 of bytes"]))) then empty
    else "\($path) is \($have | shown), crust makes \($want["base64 of bytes"]) bytes in base64" end
  elif ($want | type) == "object" then
    if ($have | type) != "object" then "\($path) is \($have | shown), crust makes an object"
    else
      (($want | keys_unsorted)[] as $k
        | if ($have | has($k)) then differences(at($path; $k); $want[$k]; $have[$k])
          else "\(at($path; $k)) is missing" end),
      ((($have | keys_unsorted) - ($want | keys_unsorted))[] as $k
        | "\(at($path; $k)) is \($have[$k] | shown), crust makes none")
    end
  elif ($want | type) == "array" then
    if ($have | type) != "array" or ($have | length) != ($want | length)
    then "\($path) is \($have | shown), crust makes \($want | shown)"
    else range(0; $want | length) as $i | differences("\($path)[\($i)]"; $want[$i]; $have[$i]) end
  elif ($have | type) == ($want | type) and $have == $want then empty
  else "\($path) is \($have | shown), crust makes \($want | shown)" end;

# The segment first: its cipher is what decides whether the data is encrypted.
[differences(""; {segments: crust_shape.segments}; {segments: .segments}),
 differences(""; crust_shape | del(.segments); del(.segments))]
| if length == 0 then empty else .[:3] | join("; ") end
