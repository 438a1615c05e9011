"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters in CPU memory or on NVMe."""
