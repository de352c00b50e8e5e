#include "pipeline/tokenizer.h"
