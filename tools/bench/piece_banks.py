#!/usr/bin/env python3
"""Shared-memory wavefronts of the staged stage layout of k3v4_nc and 3bit_nc at head_dim 64 (no GPU
needed).

  python3 tools/bench/piece_banks.py

StagedPieceLayout (attention/decode_split_config.cuh) puts a chunk's 16 slots of 56 bytes, copied
as 8-byte pieces, into 1 KB; the split pipeline (attention/decode_split_pipelines.cuh, kPieces)
reads them. This prints, for each of a warp's shared-memory accesses per chunk, the wavefronts it
takes: the largest number of distinct 4-byte words that fall into one bank (32 banks of 4 bytes),
which is what the hardware serializes. Lane = 4g + t, as in the kernels.
"""
import collections


def byte(i, b):
    """StagedPieceLayout::Byte: byte b of token i's slot within its stage."""
    i0, i1, i2, i3 = i & 1, (i >> 1) & 1, (i >> 2) & 1, (i >> 3) & 1
    return 512 * i0 + 256 * i1 + 128 * i3 + 64 * i2 + 8 * ((b >> 3) ^ (4 * i3)) + (b & 7)


def wavefronts(accesses):
    """accesses: (address, bytes) per active lane."""
    banks = collections.defaultdict(set)
    for addr, size in accesses:
        for k in range(0, size, 4):
            word = (addr + k) // 4
            banks[word % 32].add(word)
    return max(len(words) for words in banks.values())


def main():
    lanes = [(lane >> 2, lane & 3) for lane in range(32)]  # (g, t)
    rows = []
    # Copy instruction j: lane l copies piece l % 8 (none for 7) of token j + 4·(l/8 % 2) + 8·(l/16).
    for j in range(4):
        acc = [(byte(j + 4 * ((l >> 3) & 1) + 8 * (l >> 4), 8 * (l & 7)), 8)
               for l in range(32) if l & 7 != 7]
        halves = [wavefronts(acc[:14]), wavefronts(acc[14:])]
        rows.append((f"copy {j} (8-byte pieces; half-warps {halves[0]}, {halves[1]})",
                     wavefronts(acc), 2))
    # Keys of tokens 2g (kg) and 2g + 1 (k8): the word at 6t rounded down to 4 (A), and the next (B).
    for name, r in (("kg", 0), ("k8", 1)):
        for word, off in (("A", 0), ("B", 4)):
            acc = [(byte(2 * g + r, ((6 * t) & ~3) + off), 4) for g, t in lanes]
            rows.append((f"key {name} word {word}", wavefronts(acc), 1))
    # Values: 4 bytes at 24 + 4g of tokens 4t + c (v[0..3] = c 0, 2, 1, 3).
    for c in (0, 2, 1, 3):
        acc = [(byte(4 * t + c, 24 + 4 * g), 4) for g, t in lanes]
        rows.append((f"values of tokens 4t + {c}", wavefronts(acc), 1))
    # 3bit_nc (3-bit values, 48-byte slots in the same layout): 3 bytes at 24 + 3g of tokens
    # 4t + c, read as the word at 24 + 3g rounded down to 4 (lo) and the one after it (hi).
    for c in (0, 2, 1, 3):
        for word, off in (("lo", 0), ("hi", 4)):
            acc = [(byte(4 * t + c, ((24 + 3 * g) & ~3) + off), 4) for g, t in lanes]
            rows.append((f"3bit_nc values of tokens 4t + {c} ({word})", wavefronts(acc), 1))
    for name, w, least in rows:
        print(f"{name:45s} {w} wavefront(s) (least possible {least})")
    reads = sum(w for name, w, _ in rows if not name.startswith(("copy", "3bit")))
    print(f"k3v4_nc reads per chunk and warp: {reads} wavefronts (keys and values; metadata as "
          "before)")
    reads = sum(w for name, w, _ in rows
                if name.startswith(("key", "3bit")))
    print(f"3bit_nc reads per chunk and warp: {reads} wavefronts (its copies: pieces 0-5 of the "
          "same instructions)")


if __name__ == "__main__":
    main()
