"""Generated kvgen formats: one package per spec (see each package's header). Do not edit."""
