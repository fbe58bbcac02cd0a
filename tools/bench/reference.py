"""Published figures printed beside ours (copied from ../shared/REFERENCE.md).

Sources: GPipe (Huang et al., NeurIPS 2019) Tables 1–3, and torchgpipe's
README (Kakao Brain, Tesla P40). Kept as data here so that a report can be
written without the shared folder; edit both places together.
"""

from __future__ import annotations

# GPipe Table 2: normalized training throughput on TPUs, keyed by (K, M).
# Normalized to K=2, M=1 (= 1).
GPIPE_AMOEBANET = {
    (2, 1): 1.0, (4, 1): 1.13, (8, 1): 1.38,
    (2, 4): 1.07, (4, 4): 1.26, (8, 4): 1.72,
    (2, 32): 1.21, (4, 32): 1.84, (8, 32): 3.48,
}
GPIPE_TRANSFORMER = {
    (2, 1): 1.0, (4, 1): 1.07, (8, 1): 1.3,
    (2, 4): 1.7, (4, 4): 3.2, (8, 4): 4.8,
    (2, 32): 1.8, (4, 32): 3.4, (8, 32): 6.3,
}
# torchgpipe on Tesla P40s, AmoebaNet-D(18,256); n = partitions, m = M.
TORCHGPIPE_P40 = {
    (2, 1): 1.0, (4, 1): 1.004, (8, 1): 0.932,
    (2, 4): 1.539, (4, 4): 1.666, (8, 4): 2.621,
    (2, 32): 1.773, (4, 32): 2.709, (8, 32): 4.953,
}
PAPER_STAGES = (2, 4, 8)
PAPER_MICRO_BATCHES = (1, 4, 32)

# GPipe Table 3: P100 GPUs without NVLink, M=32, normalized to K=2.
GPIPE_P100 = {'AmoebaNet-D(18,128)': {2: 1.0, 4: 1.7, 8: 2.7},
              '24-layer Transformer': {2: 1.0, 4: 1.8, 8: 3.3}}

# GPipe Table 1: largest trainable AmoebaNet-D per configuration: (L, D),
# parameters, parameter memory, peak activation memory.
GPIPE_TABLE1_AMOEBANET = [
    ('Naive-1', '(18, 208)', '82M', '1.05GB', '6.26GB'),
    ('Pipeline-1', '(18, 416)', '318M', '3.8GB', '3.46GB'),
    ('Pipeline-2', '(18, 544)', '542M', '6.45GB', '8.11GB'),
    ('Pipeline-4', '(36, 544)', '1.05B', '12.53GB', '15.21GB'),
    ('Pipeline-8', '(72, 512)', '1.8B', '24.62GB', '26.24GB'),
]
# Transformer-L on TPUv3 (16 GB per core): layers and parameters.
GPIPE_TABLE1_TRANSFORMER = [
    ('Naive-1', 3, '282.2M'), ('Pipeline-1', 13, '785.8M'),
    ('Pipeline-8', 103, '5.3B'), ('Pipeline-32', 415, '21.0B'),
    ('Pipeline-128', 1663, '83.9B'),
]
