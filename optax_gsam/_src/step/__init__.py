"""One gsam/sam update, stage by stage, and the state it carries."""
