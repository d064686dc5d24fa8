"""Expert parallel: experts split over the ep ranks, the token dispatch around them."""
