"""Sharpness measured: Hessian curvature and worst-case (m-)sharpness."""
