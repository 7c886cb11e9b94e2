#!/usr/bin/env bash
# Two engines in two containers sharing one expert arena (docs/deployment.md, "Docker").
#
# The arena lives in a host directory on hugetlbfs (or tmpfs), bind-mounted into both
# containers: not in each container's own /dev/shm, which is private to it and 64 MiB unless
# --shm-size says otherwise. The first engine to start loads, the other attaches; either may
# restart and attach again. Both run as the same uid:gid (or share a group with --group-add and
# --arena-mode 0660 plus --arena-allow-foreign-owner).
#
# Who pays: the arena's pages are charged to the container that first touches them. With
# --memory limits on the engines, load from a holder container without a tight limit (the
# "holder" below) and let the engines attach; on hugetlbfs the charge is to the hugetlb
# controller, not --memory.
set -euo pipefail

IMAGE=${IMAGE:-expert-arena:latest}       # an image with moe-engine / your engine and the model
MODEL=${MODEL:-/models/qwen3-30b-a3b/model.safetensors.index.json}
HOST_ARENAS=${HOST_ARENAS:-/dev/hugepages/expert-arena}  # on the host: hugetlbfs (or a tmpfs dir)
ARENA=/arenas/qwen3-30b.arena              # the same directory, as the containers see it
UID_GID=${UID_GID:-1000:1000}

mkdir -p "$HOST_ARENAS"
chown "$UID_GID" "$HOST_ARENAS"

# The holder: loads once and keeps the arena mapped; its own memory limit must hold the arena
# when the backing is tmpfs (hugetlbfs: the hugetlb pool must).
docker run -d --name expert-arena-holder --restart unless-stopped \
  --user "$UID_GID" \
  -v "$HOST_ARENAS":/arenas -v /models:/models:ro \
  "$IMAGE" expert-arena load --model "$MODEL" --arena "$ARENA" --hold --json

# Two engines, one per GPU, each with a limit for its own memory only: attaching charges them
# nothing for the arena.
for gpu in 0 1; do
  docker run -d --name "engine-$gpu" --gpus "device=$gpu" --memory 16g \
    --user "$UID_GID" \
    -v "$HOST_ARENAS":/arenas -v /models:/models:ro \
    "$IMAGE" moe-engine --model "$MODEL" --shared-expert-arena "$ARENA" --gpu cuda:0 --json
done
