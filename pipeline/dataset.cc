#include "pipeline/corpus.h"
