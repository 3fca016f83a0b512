#!/usr/bin/env bash
# The content hash of the moec/ package: what the GPU smoke record's `source_tree` names. The same
# command here and on the GPU machine (which has no .git), so a record can be matched to a checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
find moec -type f -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-64
