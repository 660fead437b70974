"""The public transforms: gsam and sam, their argument checks, and momentum_sam."""
