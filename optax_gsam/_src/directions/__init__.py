"""Where the weights move before the perturbed pass: the perturbation maths and the ascent directions."""
